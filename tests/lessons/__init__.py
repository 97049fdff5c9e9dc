"""Every lesson executed once (the executed copies feed the book), then the book in a browser."""
