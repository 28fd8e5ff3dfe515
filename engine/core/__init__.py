"""What every model family shares: types, CPU and threads, prepared weights, int8 layers,
the network blocks, sampling, streaming and the load sequence."""
