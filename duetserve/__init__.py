"""duetserve: an LLM inference server that keeps TBT under an SLO by spatial/temporal GPU sharing."""
__version__ = "0.1.0"
