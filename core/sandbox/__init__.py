"""Running untrusted code: the sandbox, its bootstrap and bubblewrap's options."""
