"""One rank of an N-rank run, rehearsed alone (``python -m llm.rehearse``): llm.run's real
code over torch's fake process group, where collectives return at once. A top room like
llm/launch/: it imports llm.run and the rooms below it, and nothing imports it."""
