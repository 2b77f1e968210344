"""One adapter per on-disk format, plus the streaming driver that moves one layer at a time."""
