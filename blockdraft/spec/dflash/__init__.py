"""spec/dflash."""
