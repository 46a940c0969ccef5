"""What the dependency-graph tests share (Python imports, kernel header includes)."""


def find_cycle(edges):
    """One cycle of a directed graph ({node: [successors]}) as a list of nodes that starts and ends
    with the same node, or None; nodes are visited in sorted order, so the answer is stable."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in edges.get(node, ()):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for start in sorted(edges):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None
