"""What crosses a process boundary: typed messages, transports, shared memory, doorbells, keys."""
