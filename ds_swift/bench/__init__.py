"""``ds-swift bench`` (every strategy on one job, one table) and ``ds-swift demo``."""
