"""llamafleet: SSH orchestration for distributed llama.cpp RPC fleets."""

__version__ = "0.4.0"
