"""Drafter model definitions (eagle3, dflash, dspark, dflash2) and their serving format."""
