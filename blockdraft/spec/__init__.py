"""Speculative decoding: the speculator protocol (base.py) and the DFlash drafter (dflash/)."""
