"""The head process: stage processes and the wire, the request loop, prefix-cache rounds, reports."""
