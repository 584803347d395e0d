"""Where a stage runs: this process, child processes, ranks, nodes, work pools; and stopping them."""
