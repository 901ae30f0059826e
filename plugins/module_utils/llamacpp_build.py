# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The identity of a llama.cpp build and the CMake arguments that make it.

Hosts whose settings and platform give the same build id share one compile: the
id names the artifact in the controller's cache (``<id>.tar.gz``) and the
versioned install directory (``<root>/<id>``).  It is

    <label[:12]>-<backend>-<sha256(json(key material))[:10]>

where the label is the llama.cpp version (``llamacpp_build_version``, else the
git commit, else ``archive-<sha256>``) and the key material is everything that
changes what the artifact contains.  The key material is serialised exactly as
Ansible's ``to_json`` filter did when the id was computed in Jinja (``json.dumps``
with its default separators, keys in the order below), so ids, and with them
the artifact caches, stay valid.  Never reorder or rename the keys: that would
rebuild every fleet.  ``llamacpp_build``'s ``_llamacpp_build_recipe`` is part of
the key: bump it when the build script changes what an artifact contains.

Stdlib only (``llamafleet.core.llamacpp_build`` in the library).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

from .backends import BACKENDS

# GGML_RPC is always on; the rest keeps the artifact small and static.
BASE_CMAKE = (
    "-DGGML_RPC=ON",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)

# The switch that turns each backend on (module_utils/backends.py).
BACKEND_CMAKE = {name: b.cmake for name, b in BACKENDS.items()}

CCACHE_CMAKE = ("-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")

# -march=native turns on Intel AMX where the CPU has it, and ggml's AMX matrix kernels then run on it. At the
# pinned llama.cpp they die with SIGILL on the first tile instruction of a worker thread on such CPUs (seen on
# an AMX Xeon: tinygemm_kernel_amx, "tilezero %tmm4", during llama-server's warm-up; upstream's open fix requests
# the tile permission per thread). So a native x86_64 build leaves AMX out unless llamacpp_build_amx is true; GCC
# lets an explicit -mno-* win over -march=native whatever their order. On a CPU without AMX the flags
# change nothing in the artifact, but they are part of the build id all the same (the facts do not say whether a
# CPU has AMX, and an artifact compiled with it must not be reused).
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
NO_AMX_CMAKE = ("-DCMAKE_C_FLAGS=%s" % NO_AMX_FLAGS, "-DCMAKE_CXX_FLAGS=%s" % NO_AMX_FLAGS)

# The role variables (without the llamacpp_build_ prefix) a build identity reads, and their defaults.
SETTINGS = {
    "backend": "cpu",
    "source_type": "git",
    "git_repo": "",
    "git_version": "",
    "archive_sha256": "",
    "archive_subdir": "",
    "version": "",
    "cmake_args": (),
    "native": True,
    "cuda_architectures": "",
    "rocm_targets": "",
    "ccache": True,
    "amx": False,
}


class BuildSettingsError(ValueError):
    """Settings that cannot make a build; the message names the variable."""


def _settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise BuildSettingsError("unknown build settings: %s (known: %s)" % (", ".join(unknown), ", ".join(SETTINGS)))
    merged = dict(SETTINGS, **settings)
    if merged["backend"] not in BACKEND_CMAKE:
        raise BuildSettingsError("llamacpp_build_backend=%r is not one of %s"
                                 % (merged["backend"], ", ".join(BACKENDS)))
    if merged["source_type"] not in ("git", "archive"):
        raise BuildSettingsError("llamacpp_build_source_type=%r is not git or archive" % (merged["source_type"],))
    if isinstance(merged["cmake_args"], (str, bytes)) or not all(isinstance(a, str) for a in merged["cmake_args"]):
        raise BuildSettingsError("llamacpp_build_cmake_args must be a list of strings, got %r" % (merged["cmake_args"],))
    for name in ("native", "ccache", "amx"):
        if not isinstance(merged[name], bool):
            raise BuildSettingsError("llamacpp_build_%s must be a boolean, got %r" % (name, merged[name]))
    return merged


def version_label(settings: Mapping[str, Any]) -> str:
    """What the build calls its llama.cpp version: the given version, else the commit, else the archive."""
    s = _settings(settings)
    if s["version"]:
        label = str(s["version"])
    elif s["source_type"] == "git":
        label = str(s["git_version"])
    else:
        label = "archive-%s" % s["archive_sha256"]
    return label.strip()


def source_id(settings: Mapping[str, Any]) -> str:
    """The source, as the key material names it: ``repo@commit`` or ``<archive sha256>/<subdir>``."""
    s = _settings(settings)
    if s["source_type"] == "git":
        return "%s@%s" % (s["git_repo"], s["git_version"])
    return "%s/%s" % (s["archive_sha256"], s["archive_subdir"])


def cluster_source(settings: Mapping[str, Any]) -> str:
    """The llama.cpp source that must be the same on every host of a cluster (the RPC protocol comes with it).

    The git commit (whatever the repository: a mirror holds the same commit), or the archive's
    sha256 and subdirectory.  Backend, OS and CPU may differ between hosts; the source may not.
    """
    s = _settings(settings)
    if s["source_type"] == "git":
        return "git commit %s" % s["git_version"]
    return "archive sha256 %s%s" % (s["archive_sha256"], " subdir %s" % s["archive_subdir"] if s["archive_subdir"] else "")


def cluster_source_mismatch(sources: Mapping[str, str]) -> str | None:
    """None when every host has the same ``cluster_source``, else an error naming each source and its hosts.

    ``sources`` maps a host name to its ``cluster_source``.  llama.cpp RPC has no compatibility
    between builds of different sources, so a cluster runs one source or does not start.
    """
    hosts_of: dict[str, list[str]] = {}
    for host, source in sorted(sources.items()):
        hosts_of.setdefault(str(source), []).append(host)
    if len(hosts_of) <= 1:
        return None
    ranked = sorted(hosts_of.items(), key=lambda item: (-len(item[1]), item[0]))
    which = "; ".join("%s on %s" % (source, ", ".join(hosts)) for source, hosts in ranked)
    return ("the hosts would run different llama.cpp sources (%s): llama.cpp RPC needs one build of one source on "
            "every host of the cluster. Give every host the same llamacpp_build_source_type and "
            "llamacpp_build_git_version (git) or llamacpp_build_archive_url, llamacpp_build_archive_sha256 and "
            "llamacpp_build_archive_subdir (archive): set them for the whole fleet (group_vars/all), not per host "
            "or group, and upgrade all hosts at once." % which)


def cpu_model(facts: Mapping[str, Any]) -> str:
    """The CPU model from Ansible's facts (the last entry of ``processor``), or ``""``."""
    processor = facts.get("processor") or []
    return processor[-1] if processor else ""


def _no_amx(s: Mapping[str, Any], arch: str) -> tuple[str, ...]:
    """The flags that leave AMX out of a native x86_64 build (NO_AMX_FLAGS), or none."""
    return NO_AMX_CMAKE if s["native"] and not s["amx"] and arch == "x86_64" else ()


def key_material(settings: Mapping[str, Any], facts: Mapping[str, Any], recipe: int) -> dict[str, Any]:
    """Everything that changes the artifact, in the order the id hashes it.

    ``facts`` are the host's Ansible facts (``distribution``, ``distribution_major_version``,
    ``architecture``, ``processor``); the CPU model counts only for ``-march=native`` builds.
    """
    s = _settings(settings)
    missing = [name for name in ("distribution", "distribution_major_version", "architecture") if not facts.get(name)]
    if missing:
        raise BuildSettingsError("the build identity needs the host's facts %s: gather facts first" % ", ".join(missing))
    native = s["native"]
    return {
        "recipe": recipe,
        "source": source_id(s),
        "backend": s["backend"],
        "cmake": (list(BASE_CMAKE) + list(BACKEND_CMAKE[s["backend"]]) + list(_no_amx(s, facts["architecture"]))
                  + list(s["cmake_args"])),
        "native": native,
        "cpu": cpu_model(facts) if native else "",
        "cuda_arch": s["cuda_architectures"],
        "rocm_targets": s["rocm_targets"],
        "os": "%s-%s" % (facts["distribution"], facts["distribution_major_version"]),
        "arch": facts["architecture"],
    }


def cmake_args(settings: Mapping[str, Any], arch: str = "") -> list[str]:
    """The CMake arguments of the build: base, backend, native (without AMX on x86_64: NO_AMX_FLAGS), GPU targets,
    ccache, then the user's own (a CMAKE_C_FLAGS or CMAKE_CXX_FLAGS of theirs replaces the AMX flags)."""
    s = _settings(settings)
    args = list(BASE_CMAKE) + list(BACKEND_CMAKE[s["backend"]])
    args.append("-DGGML_NATIVE=ON" if s["native"] else "-DGGML_NATIVE=OFF")
    args.extend(_no_amx(s, arch))
    targets = BACKENDS[s["backend"]].gpu_targets
    if targets and s[targets[0]]:
        args.append("-D%s=%s" % (targets[1], s[targets[0]]))
    if s["ccache"]:
        args.extend(CCACHE_CMAKE)
    return args + list(s["cmake_args"])


def build_identity(settings: Mapping[str, Any], facts: Mapping[str, Any], recipe: int) -> dict[str, Any]:
    """``{id, label, cmake, source}``: the build id, the llama.cpp version label, the CMake arguments and
    the ``cluster_source`` that every host of the cluster must share."""
    label = version_label(settings)
    material = json.dumps(key_material(settings, facts, recipe))
    digest = hashlib.sha256(material.encode("utf-8")).hexdigest()
    backend = _settings(settings)["backend"]
    return {"id": "%s-%s-%s" % (label[:12], backend, digest[:10]), "label": label,
            "cmake": cmake_args(settings, facts["architecture"]), "source": cluster_source(settings)}
