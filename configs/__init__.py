"""relaytrain's Hydra configs, shipped as the package `relaytrain.configs`."""
