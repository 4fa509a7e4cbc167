"""kxlb."""
