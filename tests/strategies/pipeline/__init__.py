"""Tests of `relaytrain.strategies.pipeline`, one file per module they test."""
