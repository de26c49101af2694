"""paxcli: Pax-style machine-learning experiments on JAX."""

__version__ = '0.1.0'
