"""Property test of the host-side page allocator."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxspec.cache.paged import NULL_PAGE, OutOfPagesError, PageAllocator

ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 5), st.integers(0, 40)),
        st.tuples(st.just("free"), st.integers(0, 5), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(num_pages=st.integers(2, 24), page_size=st.integers(1, 8), ops=ops)
def test_alloc_free_keeps_invariants(num_pages, page_size, ops):
    alloc = PageAllocator(num_pages, page_size)
    for op, seq, tokens in ops:
        if op == "alloc":
            before = alloc.owned(seq)
            try:
                pages = alloc.allocate(seq, tokens)
            except OutOfPagesError:
                # A failed grow changes nothing.
                assert alloc.owned(seq) == before
            else:
                assert pages[: len(before)] == before, "growing must keep existing pages"
                assert len(pages) >= alloc.pages_for(tokens)
        else:
            alloc.free(seq)
        owned = [p for s in range(6) for p in alloc.owned(s)]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        assert NULL_PAGE not in owned, "the null page was handed out"
        assert all(1 <= p < num_pages for p in owned)
        assert alloc.num_used + alloc.num_free == alloc.total
        assert alloc.num_used == len(owned)
    for seq in range(6):
        alloc.free(seq)
    assert alloc.num_used == 0 and alloc.num_free == alloc.total


def test_page_table_row_pads_with_null_page():
    alloc = PageAllocator(8, 4)
    pages = alloc.allocate("a", 9)
    row = alloc.page_table_row("a", 5)
    assert row.tolist() == pages + [NULL_PAGE] * 2


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(1, 4)
    with pytest.raises(ValueError, match="page_size"):
        PageAllocator(4, 0)
