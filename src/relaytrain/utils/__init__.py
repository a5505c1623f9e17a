"""Utilities every layer may use: errors, atomic files, stdio, units, module discovery, failpoints."""
