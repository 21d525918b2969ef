"""`make demo`: flash inference on the default model in every engine mode (flash), then Endor compression (endor)."""
