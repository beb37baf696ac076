"""capture: offline hidden-state capture for training speculative-decoding drafters.

``capture.run(capture.RunConfig(out=...))`` runs (or resumes) a capture and returns its summary; the
``capture`` command line does the same (``cli.py``).
"""

from capture.config import RunConfig

__version__ = "0.1.0"
__all__ = ["RunConfig", "run"]


def run(config: RunConfig):
    """Run, resume or extend the capture described by ``config``; see :func:`capture.driver.run`."""
    from capture.driver import run as _run  # torch, transformers and ray load only when a run starts

    return _run(config)
