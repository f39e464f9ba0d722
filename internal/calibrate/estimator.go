package calibrate

import "math"

// dim is the number of coefficients of each fitted time (see Model).
const dim = 4

// vec and mat are the estimator's vectors and matrices: fixed size, so an
// update allocates nothing.
type (
	vec [dim]float64
	mat [dim][dim]float64
)

func dot(a, b vec) float64 {
	s := 0.0
	for i := range a {
		s += a[i] * b[i]
	}
	return s
}

// estimator fits y ≈ θ·x by weighted least squares with exponential
// forgetting, in information form, stabilised towards a prior:
//
//	R ← λ·R + w·x·xᵀ,   b ← λ·b + w·x·y
//	θ = (R₀ + R)⁻¹·(R₀·θ₀ + b)
//
// R₀ = diag(prec) is the prior's information and θ₀ its mean. Without data
// θ = θ₀; the prior keeps the weight of a few observations for ever while
// recent data (about 1/(1−λ) of them) dominate, and a direction the data
// stop exciting drifts back to the prior instead of winding up — the failure
// of plain exponential-forgetting RLS (Ljung, "System Identification",
// §11.2) when every request is alike for a while. It is the stabilised
// forgetting of Kulhavý and Zarrop ("On a general concept of forgetting",
// Int. J. Control 58, 1993: R ← λR + (1−λ)R₀ + w·x·xᵀ) with R started at R₀,
// written so that θ₀ may move — a replica's fit is pulled towards its
// pool's as it is now, not as it was.
//
// Observations are relative: x and y are divided by norm, the prior's
// prediction of y, so that a 10 ms prefill and a 10 s one count alike.
// Each is weighted by Huber's rule (Huber, "Robust Estimation of a Location
// Parameter", 1964) on its a-priori residual relative to the fit: beyond k
// robust scales the weight falls as k·s/|r|, so a prefill that waited
// behind work the router could not see moves the fit only a little. The
// first solveWarmup observations, before there is a scale to judge by, are
// taken whole.
//
// The solve is a 4×4 Cholesky factorisation, done after each of the first
// solveWarmup observations and then every solveEvery-th: between solves θ
// lags by a few observations of the ~200 it weighs, and the router pays a
// solve per several requests instead of two per request (BenchmarkRoute-
// Calibration in internal/router).
type estimator struct {
	// prior is the mean the fit is pulled towards (it may move: a
	// replica's fit is pulled towards its pool's); ref the profile's own
	// coefficients, which the prior figures (errPrior, priorSum) report.
	theta, prior, ref, prec vec
	info                    mat
	b                       vec
	forget                  float64 // λ
	k                       float64 // Huber's threshold in robust scales
	scale                   float64 // robust scale of relative residuals: EWMA of min(|r|, 4·scale)
	// errFit and errPrior are EWMAs of |ŷ/y − 1| for the fit (before the
	// observation updates it) and for the prior.
	errFit, errPrior float64
	// quiet skips the figures below (a pool's fit, which nothing reports).
	quiet bool
	// predSum, priorSum and obsSum are decaying sums (about the last 100
	// observations) of the fit's a-priori predictions, the prior's and the
	// observations, in seconds: their ratios say whether the fit agrees with
	// what the replica did over a stretch of its work, not only on average
	// per observation.
	predSum, priorSum, obsSum float64
	n                         int64  // observations used
	stale                     int    // observations since θ was solved
	ver                       uint64 // counts solves: θ's version, for the caches of its figures
	poolVer                   uint64 // the pool fit's ver when prior was last taken from it
}

// Robust-scale bounds and the EWMA rate of the error figures.
const (
	scaleInit  = 0.25
	scaleFloor = 0.02
	ewmaRate   = 0.05
	sumDecay   = 0.99
	// solveWarmup observations are each solved at once (the fit moves most
	// then); after them θ is solved every solveEvery observations.
	solveWarmup = 16
	solveEvery  = 8
	// maxFeature bounds a normalised feature (a 1-token prefill's share of
	// a per-request constant can be huge): the estimate stays finite.
	maxFeature = 1e4
)

func newEstimator(prior, prec vec, forget, k float64) estimator {
	return estimator{theta: prior, prior: prior, ref: prior, prec: prec, forget: forget, k: k, scale: scaleInit}
}

// update adds the observation y ≈ θ·x with weight w in (0, 1]; norm > 0 is
// the prior's prediction of y. It reports whether the observation was used
// (false for non-finite or non-positive input).
func (e *estimator) update(x vec, y, norm, w float64) bool {
	if !(norm > 0) || !(y > 0) || !(w > 0) || math.IsInf(y, 0) || math.IsInf(norm, 0) {
		return false
	}
	var xn vec
	for i := range x {
		v := x[i] / norm
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return false
		}
		xn[i] = max(-maxFeature, min(maxFeature, v))
	}
	yn := y / norm
	pred := dot(e.theta, xn)
	r := (yn - pred) / max(math.Abs(pred), 0.05)
	if !e.quiet {
		e.report(xn, yn, pred, norm, y)
	}
	ar := math.Abs(r)
	if e.n < solveWarmup {
		// No scale to judge by yet: the first observations are taken
		// whole (a prior 4× off must not make every one an outlier), and
		// the scale starts as their mean residual.
		e.scale += (min(ar, 10) - e.scale) / float64(e.n+1)
	} else {
		if lim := e.k * e.scale; ar > lim {
			w *= lim / ar
		}
		e.scale += ewmaRate * (min(ar, 4*e.scale) - e.scale)
	}
	e.scale = max(e.scale, scaleFloor)

	// info is symmetric: only its lower triangle is kept (solve reads
	// nothing else).
	l := e.forget
	for i := 0; i < dim; i++ {
		wx := w * xn[i]
		for j := 0; j <= i; j++ {
			e.info[i][j] = l*e.info[i][j] + wx*xn[j]
		}
		e.b[i] = l*e.b[i] + wx*yn
	}
	e.n++
	e.stale++
	if e.n <= solveWarmup || e.stale >= solveEvery {
		e.refresh()
	}
	return true
}

// report updates the error and agreement figures with an observation yn
// (normalised; y in seconds) that the fit predicted as pred.
func (e *estimator) report(xn vec, yn, pred, norm, y float64) {
	e.predSum = sumDecay*e.predSum + pred*norm
	e.priorSum = sumDecay*e.priorSum + dot(e.ref, xn)*norm
	e.obsSum = sumDecay*e.obsSum + y
	if e.n == 0 {
		e.errFit, e.errPrior = relErr(pred, yn), relErr(dot(e.ref, xn), yn)
	} else {
		e.errFit += ewmaRate * (relErr(pred, yn) - e.errFit)
		e.errPrior += ewmaRate * (relErr(dot(e.ref, xn), yn) - e.errPrior)
	}
}

// refresh solves θ from the information gathered so far and the prior.
func (e *estimator) refresh() {
	a, rhs := e.info, e.b
	for i := 0; i < dim; i++ {
		a[i][i] += e.prec[i]
		rhs[i] += e.prec[i] * e.prior[i]
	}
	if th, ok := solve(a, rhs); ok {
		e.theta = th
	}
	e.stale = 0
	e.ver++
}

// relErr is |pred/y − 1|, capped at 10 (a figure for dashboards, not an
// input to the fit).
func relErr(pred, y float64) float64 {
	if !(y > 0) {
		return 0
	}
	return min(math.Abs(pred/y-1), 10)
}

// solve returns A⁻¹·b for a symmetric positive definite A, given by its
// lower triangle (a[i][j], j ≤ i), by Cholesky factorisation; false when A
// is not (numerically) positive definite.
func solve(a mat, b vec) (vec, bool) {
	var l mat
	for i := 0; i < dim; i++ {
		for j := 0; j <= i; j++ {
			s := a[i][j]
			for k := 0; k < j; k++ {
				s -= l[i][k] * l[j][k]
			}
			if i == j {
				if !(s > 0) {
					return vec{}, false
				}
				l[i][i] = math.Sqrt(s)
			} else {
				l[i][j] = s / l[j][j]
			}
		}
	}
	var y, x vec
	for i := 0; i < dim; i++ {
		s := b[i]
		for k := 0; k < i; k++ {
			s -= l[i][k] * y[k]
		}
		y[i] = s / l[i][i]
	}
	for i := dim - 1; i >= 0; i-- {
		s := y[i]
		for k := i + 1; k < dim; k++ {
			s -= l[k][i] * x[k]
		}
		x[i] = s / l[i][i]
	}
	for _, v := range x {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return vec{}, false
		}
	}
	return x, true
}
