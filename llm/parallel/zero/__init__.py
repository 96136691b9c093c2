"""Our ZeRO stages 1-3 (``parallelism=zero1|zero2|zero3``); importing registers them."""

from llm.parallel.zero.strategy import Zero1, Zero2, Zero3, ZeroStrategy

__all__ = ["Zero1", "Zero2", "Zero3", "ZeroStrategy"]
