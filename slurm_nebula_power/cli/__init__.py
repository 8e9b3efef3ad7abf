"""The command layer: argv, logging set-up, process hygiene, errors -> exit codes and the one stderr line.

One small module per command, each calling typed functions of the library; nothing below imports this.
"""
