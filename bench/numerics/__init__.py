"""What a format does to numbers: element formats, block scaling, precision policy, loss and unit scaling,
telemetry and memory accounting."""
