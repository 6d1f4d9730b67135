"""A prompt cache that lasts: where a held cache resumes a longer prompt exactly (resume), the file a cache is kept
in (file), the disk store of compressed prompt caches (store) and tq-server's prompt cache over both tiers (lru)."""
