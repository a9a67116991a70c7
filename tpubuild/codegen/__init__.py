"""Backend: layer group, memory assign, command set and the .model file."""
