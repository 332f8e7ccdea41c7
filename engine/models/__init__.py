"""Model families (one file each), the loader, built-in and synthetic models."""
