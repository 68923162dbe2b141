"""TEST STAND-IN: ``Run`` exists only so that annotations resolve."""


class Run:
    pass
