/*
 * llamafleet-fnv1a64: FNV-1a 64-bit hashes of byte ranges of one file.
 *
 * Copyright: llamafleet maintainers
 * GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
 *
 * llama.cpp's rpc-server names its weight cache files after the FNV-1a 64 hash
 * (offset basis 0xcbf29ce484222325, prime 0x100000001b3, xor then multiply) of
 * a tensor's bytes.  llamafleet hashes the tensors of a local GGUF file with this
 * helper to fill a worker's cache before the first load.  Python needs ~100x
 * longer for the same loop.
 *
 * Usage:
 *   llamafleet-fnv1a64 [-j THREADS] FILE [OFFSET:LENGTH ...]
 *
 * Ranges are decimal byte offsets and lengths.  When none are given on the
 * command line they are read from standard input, separated by white space.
 * Output: one line per range, in the order given, with the hash as 16 lowercase
 * hex digits.  With -j, up to THREADS ranges are hashed at the same time (one
 * range is always hashed by one thread: FNV-1a is a serial chain).
 *
 * Exit status: 0 on success, 1 on an I/O error or a range outside the file,
 * 2 on a usage error.  Errors go to standard error and name the file.
 *
 * Build: cc -O2 -pthread -o llamafleet-fnv1a64 llamafleet-fnv1a64.c
 */

#define _FILE_OFFSET_BITS 64
#define _GNU_SOURCE

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define FNV1A64_BASIS UINT64_C(0xcbf29ce484222325)
#define FNV1A64_PRIME UINT64_C(0x100000001b3)
#define READ_CHUNK ((size_t)8 << 20)
#define MAX_THREADS 256

struct range {
    uint64_t offset;
    uint64_t length;
    uint64_t hash;
    int error; /* errno of a failed read, or -1 for a short read */
};

struct job {
    const char *path;
    int fd;
    struct range *ranges;
    size_t count;
    size_t next;
    pthread_mutex_t lock;
};

static uint64_t fnv1a64_update(uint64_t hash, const unsigned char *data, size_t len)
{
    const unsigned char *end = data + len;

    while (data < end) {
        hash ^= *data++;
        hash *= FNV1A64_PRIME;
    }
    return hash;
}

static void hash_range(int fd, struct range *r, unsigned char *buf)
{
    uint64_t hash = FNV1A64_BASIS;
    uint64_t pos = r->offset;
    uint64_t left = r->length;

#ifdef POSIX_FADV_SEQUENTIAL
    (void)posix_fadvise(fd, (off_t)r->offset, (off_t)r->length, POSIX_FADV_SEQUENTIAL);
#endif
    while (left > 0) {
        size_t want = left < READ_CHUNK ? (size_t)left : READ_CHUNK;
        ssize_t got = pread(fd, buf, want, (off_t)pos);

        if (got < 0) {
            if (errno == EINTR)
                continue;
            r->error = errno;
            return;
        }
        if (got == 0) {
            r->error = -1;
            return;
        }
        hash = fnv1a64_update(hash, buf, (size_t)got);
        pos += (uint64_t)got;
        left -= (uint64_t)got;
    }
    r->hash = hash;
}

static void *worker(void *arg)
{
    struct job *job = arg;
    unsigned char *buf = malloc(READ_CHUNK);

    if (buf == NULL)
        return (void *)1;
    for (;;) {
        size_t i;

        pthread_mutex_lock(&job->lock);
        i = job->next++;
        pthread_mutex_unlock(&job->lock);
        if (i >= job->count)
            break;
        hash_range(job->fd, &job->ranges[i], buf);
    }
    free(buf);
    return NULL;
}

static int parse_u64(const char *s, const char *end, uint64_t *out)
{
    uint64_t value = 0;

    if (s == end)
        return -1;
    for (; s < end; s++) {
        unsigned digit;

        if (*s < '0' || *s > '9')
            return -1;
        digit = (unsigned)(*s - '0');
        if (value > (UINT64_MAX - digit) / 10)
            return -1;
        value = value * 10 + digit;
    }
    *out = value;
    return 0;
}

static int parse_range(const char *spec, struct range *r)
{
    const char *colon = strchr(spec, ':');

    if (colon == NULL)
        return -1;
    if (parse_u64(spec, colon, &r->offset) != 0)
        return -1;
    if (parse_u64(colon + 1, colon + 1 + strlen(colon + 1), &r->length) != 0)
        return -1;
    r->hash = 0;
    r->error = 0;
    return 0;
}

static int add_range(struct range **ranges, size_t *count, size_t *cap, const char *spec)
{
    if (*count == *cap) {
        size_t ncap = *cap ? *cap * 2 : 64;
        struct range *grown = realloc(*ranges, ncap * sizeof(**ranges));

        if (grown == NULL) {
            fprintf(stderr, "llamafleet-fnv1a64: out of memory\n");
            return -1;
        }
        *ranges = grown;
        *cap = ncap;
    }
    if (parse_range(spec, &(*ranges)[*count]) != 0) {
        fprintf(stderr, "llamafleet-fnv1a64: bad range '%s' (expected OFFSET:LENGTH in decimal bytes)\n", spec);
        return -2;
    }
    (*count)++;
    return 0;
}

static int read_ranges_from_stdin(struct range **ranges, size_t *count, size_t *cap)
{
    char token[64];
    int rc;

    for (;;) {
        rc = scanf("%63s", token);
        if (rc == EOF)
            return 0;
        if (rc != 1 || strlen(token) == sizeof(token) - 1) {
            fprintf(stderr, "llamafleet-fnv1a64: unreadable range on standard input\n");
            return -2;
        }
        rc = add_range(ranges, count, cap, token);
        if (rc != 0)
            return rc;
    }
}

static void usage(void)
{
    fprintf(stderr,
            "usage: llamafleet-fnv1a64 [-j THREADS] FILE [OFFSET:LENGTH ...]\n"
            "Prints the FNV-1a 64 hash of each byte range of FILE (ranges from stdin when none are given).\n");
}

int main(int argc, char **argv)
{
    struct job job;
    struct range *ranges = NULL;
    size_t count = 0, cap = 0, i;
    long threads = 1;
    int argi = 1, rc, status = 0;
    struct stat st;
    pthread_t tids[MAX_THREADS];
    long started = 0;

    while (argi < argc && argv[argi][0] == '-' && argv[argi][1] != '\0') {
        if (strcmp(argv[argi], "-j") == 0 && argi + 1 < argc) {
            char *end;

            threads = strtol(argv[argi + 1], &end, 10);
            if (*end != '\0' || threads < 1 || threads > MAX_THREADS) {
                fprintf(stderr, "llamafleet-fnv1a64: -j wants a number from 1 to %d\n", MAX_THREADS);
                return 2;
            }
            argi += 2;
        } else if (strcmp(argv[argi], "--") == 0) {
            argi++;
            break;
        } else {
            usage();
            return 2;
        }
    }
    if (argi >= argc) {
        usage();
        return 2;
    }
    job.path = argv[argi++];

    for (; argi < argc; argi++) {
        rc = add_range(&ranges, &count, &cap, argv[argi]);
        if (rc != 0)
            return rc == -1 ? 1 : 2;
    }
    if (count == 0) {
        rc = read_ranges_from_stdin(&ranges, &count, &cap);
        if (rc != 0)
            return rc == -1 ? 1 : 2;
    }

    job.fd = open(job.path, O_RDONLY | O_CLOEXEC);
    if (job.fd < 0) {
        fprintf(stderr, "llamafleet-fnv1a64: %s: %s\n", job.path, strerror(errno));
        return 1;
    }
    if (fstat(job.fd, &st) != 0) {
        fprintf(stderr, "llamafleet-fnv1a64: %s: %s\n", job.path, strerror(errno));
        return 1;
    }
    for (i = 0; i < count; i++) {
        if (ranges[i].offset > (uint64_t)st.st_size || ranges[i].length > (uint64_t)st.st_size - ranges[i].offset) {
            fprintf(stderr, "llamafleet-fnv1a64: %s: range %" PRIu64 ":%" PRIu64 " ends past the end of the file (%" PRIu64 " bytes)\n",
                    job.path, ranges[i].offset, ranges[i].length, (uint64_t)st.st_size);
            return 1;
        }
    }

    job.ranges = ranges;
    job.count = count;
    job.next = 0;
    pthread_mutex_init(&job.lock, NULL);
    if ((size_t)threads > count)
        threads = count > 0 ? (long)count : 1;
    for (started = 0; started < threads - 1; started++) {
        if (pthread_create(&tids[started], NULL, worker, &job) != 0)
            break;
    }
    if (worker(&job) != NULL)
        status = 1;
    for (long t = 0; t < started; t++) {
        void *ret = NULL;

        pthread_join(tids[t], &ret);
        if (ret != NULL)
            status = 1;
    }
    if (status != 0) {
        fprintf(stderr, "llamafleet-fnv1a64: out of memory\n");
        return 1;
    }

    for (i = 0; i < count; i++) {
        if (ranges[i].error != 0) {
            fprintf(stderr, "llamafleet-fnv1a64: %s: reading %" PRIu64 ":%" PRIu64 ": %s\n", job.path,
                    ranges[i].offset, ranges[i].length,
                    ranges[i].error < 0 ? "file shrank while reading" : strerror(ranges[i].error));
            return 1;
        }
    }
    for (i = 0; i < count; i++)
        printf("%016" PRIx64 "\n", ranges[i].hash);
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "llamafleet-fnv1a64: writing the hashes: %s\n", strerror(errno));
        return 1;
    }
    free(ranges);
    close(job.fd);
    return 0;
}
