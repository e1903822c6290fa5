"""The console's tests: its files and headers, and the page in headless Debian chromium."""
