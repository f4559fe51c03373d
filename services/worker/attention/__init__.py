"""Attention backends behind one interface, all driven by AttentionMetadata."""
from services.worker.attention.metadata import AttentionMetadata
from services.worker.attention.torch_sdpa import TorchSDPABackend

__all__ = ["AttentionMetadata", "TorchSDPABackend"]
