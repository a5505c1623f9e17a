"""The user's commands: `relaytrain train|plan|report|export|generate|schedule|profile`, their help and sweeps."""
