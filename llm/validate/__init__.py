"""Cross-group checks on a whole Config, run once before any rank starts (train.py, the
estimator): each refusal is one line naming the problem and the fix. They need the model
registry, the strategies, the kernels and the device, so this room may import every room
below llm.run; train.py and llm.estimate import it, llm.config does not."""

from llm.validate.checks import check_vocab, validate

__all__ = ["check_vocab", "validate"]
