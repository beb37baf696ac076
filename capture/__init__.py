"""capture: offline hidden-state capture for training speculative-decoding drafters.

``capture.run(capture.RunConfig(out=...))`` runs (or resumes) a capture and returns its summary; the
``capture`` command line does the same (``cli.py``).

Importing this package loads nothing else: ``RunConfig`` and the pipeline load on first use. The leaf
modules every layer shares (errors, hashing, record types) are the package :mod:`common`, below this one.
``__version__`` is the package's one version (pyproject.toml reads it).
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["RunConfig", "run"]


def __getattr__(name: str):
    if name == "RunConfig":
        from capture.config import RunConfig

        return RunConfig
    raise AttributeError(f"module 'capture' has no attribute {name!r}")


def run(config):
    """Run, resume or extend the capture described by ``config`` (a :class:`capture.config.RunConfig`);
    see :func:`capture.driver.run`."""
    from capture.driver import run as _run  # torch, transformers and ray load only when a run starts

    return _run(config)
