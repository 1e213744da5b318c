"""EAGLE-family draft heads (EAGLE-1/2, EAGLE-3) and their public checkpoint formats."""

from specserve.speculative.models.base import DraftHead, DraftHeadConfig, HeadOutput, TargetRefs
from specserve.speculative.models.eagle3_head import Eagle3Head, default_capture_layers
from specserve.speculative.models.eagle_head import EagleHead
from specserve.speculative.models.loader import detect_format, load_draft_head, save_eagle3_head

__all__ = [
    "DraftHead", "DraftHeadConfig", "Eagle3Head", "EagleHead", "HeadOutput", "TargetRefs",
    "default_capture_layers", "detect_format", "load_draft_head", "save_eagle3_head",
]
