package prefixtree

import "math/bits"

// Set is a set of replica indexes. The first 64 live inline, so the common
// cluster sizes cost no allocation; larger clusters spill into a slice held
// by pointer, so that a Set is two words (every Node holds two).
// The zero value is the empty set. A copy made by assignment shares the
// spilled words; use Clone for an independent one.
type Set struct {
	w0   uint64
	more *[]uint64 // words for replicas 64 and up; nil while none was added
}

// Has reports whether r is in the set.
func (s *Set) Has(r int) bool {
	if r < 64 {
		return r >= 0 && s.w0&(1<<uint(r)) != 0
	}
	if s.more == nil {
		return false
	}
	i := r/64 - 1
	return i < len(*s.more) && (*s.more)[i]&(1<<uint(r%64)) != 0
}

// Add puts r in the set.
func (s *Set) Add(r int) {
	if r < 64 {
		s.w0 |= 1 << uint(r)
		return
	}
	if s.more == nil {
		s.more = new([]uint64)
	}
	i := r/64 - 1
	for len(*s.more) <= i {
		*s.more = append(*s.more, 0)
	}
	(*s.more)[i] |= 1 << uint(r%64)
}

// Remove takes r out of the set.
func (s *Set) Remove(r int) {
	if r < 64 {
		s.w0 &^= 1 << uint(r)
		return
	}
	if s.more == nil {
		return
	}
	if i := r/64 - 1; i < len(*s.more) {
		(*s.more)[i] &^= 1 << uint(r%64)
	}
}

// Len is the number of members.
func (s *Set) Len() int {
	n := bits.OnesCount64(s.w0)
	if s.more != nil {
		for _, w := range *s.more {
			n += bits.OnesCount64(w)
		}
	}
	return n
}

// Empty reports whether the set has no members.
func (s *Set) Empty() bool { return s.w0 == 0 && s.Len() == 0 }

// Clear empties the set.
func (s *Set) Clear() {
	s.w0 = 0
	s.more = nil
}

// Each calls fn for every member in increasing order.
func (s *Set) Each(fn func(r int)) {
	for w := s.w0; w != 0; w &= w - 1 {
		fn(bits.TrailingZeros64(w))
	}
	if s.more == nil {
		return
	}
	for i, w := range *s.more {
		for ; w != 0; w &= w - 1 {
			fn((i+1)*64 + bits.TrailingZeros64(w))
		}
	}
}

// Clone returns an independent copy.
func (s Set) Clone() Set {
	if s.more != nil {
		m := append([]uint64(nil), *s.more...)
		s.more = &m
	}
	return s
}
