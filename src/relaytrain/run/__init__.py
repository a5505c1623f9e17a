"""One run: composed, resolved once (resolve.py), checked, launched, looped (train.py), its results."""
