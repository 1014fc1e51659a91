"""bestiary.core.layers."""
