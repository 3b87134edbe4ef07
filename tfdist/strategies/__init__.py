"""What is synchronised and when: one module per mode."""
