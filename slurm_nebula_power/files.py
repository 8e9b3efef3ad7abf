"""Files in directories other users can write: opened without following links, checked, capped."""
