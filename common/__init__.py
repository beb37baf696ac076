"""The leaf package every layer shares: the user-facing error (:mod:`common.errors`), the SHA-256 hashes the
manifest, shards and provenance rely on (:mod:`common.hashing`) and the record types the stages pass along
(:mod:`common.records`).

It imports only the standard library and numpy, so ``shards``, ``filters`` and ``provenance`` use it without
loading ``capture`` (tests/test_imports.py checks both that and that no module import closes a circle).
"""
