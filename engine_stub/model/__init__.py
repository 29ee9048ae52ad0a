"""The reference model: a faithful miniature of DeepSeek-V4.1-Flash (see model.py)."""

from .config import ModelConfig
from .dspark import Draft
from .memory import memory_model
from .model import MiniV4, ReplayStats, VerifyStats
from .state import SeqState
from .tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer",
    "Draft",
    "MiniV4",
    "ModelConfig",
    "ReplayStats",
    "SeqState",
    "VerifyStats",
    "memory_model",
]
