"""Hand-written companions of the generated kvtag.v1 stubs, shared by service and client."""
