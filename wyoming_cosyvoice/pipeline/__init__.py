"""The speech pipeline every front end drives: sentences, the scheduler over the engine's
threads, the repeat cache and the phrases prepared into it, the server's metrics."""
