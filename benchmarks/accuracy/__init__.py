"""The accuracy study: estimates against measurements of the same steps."""
