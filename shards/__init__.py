"""Shards: the on-disk format (``format``), atomic writing (``writer``), the commit log (``manifest``),
reading (``reader``) and integrity checks (``verify``)."""
