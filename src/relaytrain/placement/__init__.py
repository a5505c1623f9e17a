"""Where each process sits: its world (rank, device, stop requests) and the layout of its degrees."""
