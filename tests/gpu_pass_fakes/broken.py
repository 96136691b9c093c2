"""A section that fails before any row: the runner must report it and go on."""


def run(dry: bool):
    raise RuntimeError("this section is broken on purpose")
