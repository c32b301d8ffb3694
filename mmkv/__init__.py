"""mmkv package."""
