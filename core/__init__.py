"""bestiary.core."""
