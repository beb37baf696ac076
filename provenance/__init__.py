"""``provenance.json``: what a run folder was made from, and ``capture provenance verify``.

:mod:`provenance.record` writes the file (at run start and at the end of every invocation);
:mod:`provenance.verify` recomputes every hash it records, and every shard hash of the manifest.
"""

from provenance.record import PROVENANCE, read, start, finish

__all__ = ["PROVENANCE", "read", "start", "finish"]
