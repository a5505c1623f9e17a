"""Tests of `relaytrain.strategies`, one file per module they test."""
