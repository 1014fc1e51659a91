"""bestiary.models."""
