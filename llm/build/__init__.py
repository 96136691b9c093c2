"""Builders that read a whole Config for the rooms that must not import it: the model's
shape (llm.models), the tokenizer's vocabulary known before it is built, and the device.
Imports llm.config, llm.models, llm.data and llm.errors; llm.run, llm.estimate,
llm.inference and llm.validate import it."""

from llm.build.device import resolve_device
from llm.build.model_args import model_args_for, tokenizer_vocab_size

__all__ = ["model_args_for", "resolve_device", "tokenizer_vocab_size"]
